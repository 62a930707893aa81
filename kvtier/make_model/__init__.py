"""Checkpoints kvtier can serve without a model hub: generated shapes (presets), their
writer and the tokenizer they are trained with."""
