"""Data: text and tasks, turned into batches.

text.py       documents, the embedded corpus, memory-mapped token arrays, windows and samplers
tokenizer.py  byte and BPE tokenizers
tasks.py      the built-in reasoning-task generators and JSONL task files
taskdata.py   task examples as training batches (difficulties, curricula, traces) and their evaluation
"""
