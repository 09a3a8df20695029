"""DeepSeek V4 model family for ds4-core."""
