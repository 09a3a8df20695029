"""`ds4 bench`: synthetic DeepSeek V4 Flash, GLM 5.3 Flash and Qwen3.8 Flash Next built in GPU memory, reported against
measured device ceilings."""
