"""`looplm bench`: decode.py and train.py, on the matched bench-s configuration, peers in the same run."""
