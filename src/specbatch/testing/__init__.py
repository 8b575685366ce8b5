"""Test fixtures other projects can use too: a deterministic fake model and tiny random
mlx-lm models with a real tokenizer."""
