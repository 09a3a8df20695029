"""`ds4 bench`: synthetic DeepSeek V4 benchmarks built in GPU memory, reported against measured device ceilings."""
