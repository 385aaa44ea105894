"""Width policies: how many rows each round verifies (fixed, `--width auto`, D-cut for a batch) and the
verify costs they are decided by."""
