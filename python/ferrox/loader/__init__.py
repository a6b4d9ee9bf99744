"""Everything between a model path and a ready model: where it is (source.py), its shape
(model_config.py reads config.json or GGUF metadata into a ferrox.model_spec.ModelSpec), its
weights (model_loader.py, weights.py, gguf_file.py), its tokenizer and chat template
(tokenizer.py, gguf_tokenizer.py, chat_template.py), and the errors they raise (errors.py).
Imports stay lazy: `import ferrox.loader.source` does not import torch."""
