"""The models: the tiny model built from scratch, pretrained checkpoints, the attention of packed rows."""
