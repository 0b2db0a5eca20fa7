"""Experiments built from recipes and runs: extrapolate.py (`experiment extrapolate`), depth.py (`experiment
depth`), deeploop.py, loopmoe.py, looping.py (`experiment looping`), retrofit.py (`experiment retrofit`)."""
