"""Model definitions, one file per family (llama.py, qwen.py), looked up by registry.py."""
