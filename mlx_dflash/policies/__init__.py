"""Width policies: how many rows each round verifies (fixed, or `--width auto`: D-cut, for one request or a
batch) and the verify costs they are decided by."""
