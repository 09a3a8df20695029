"""Qwen3.8 Flash Next (``qwen4exp``) model plugin for ds4-core."""
