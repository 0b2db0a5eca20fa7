"""Data: text and tasks, turned into batches.

sources.py    what data.path points at (text, JSONL, parquet, a saved datasets folder), streamed as documents
text.py       the train/validation split, memory-mapped token arrays and shards, windows and samplers
prepared.py   `looplm data prepare`: a corpus tokenized once into resumable shards, and training from them
tokenizer.py  byte and BPE tokenizers
tasks.py      the built-in reasoning-task generators and JSONL task files
taskdata.py   task examples as training batches (difficulties, curricula, traces) and their evaluation
"""
