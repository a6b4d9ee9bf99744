"""Image inputs for vision-language models (LLaVA, Gemma 3): where an image comes from and how it is
decoded (media.py), the pixel values the vision tower takes (image_processor.py), a prompt's image
placeholders (processing.py, chat_parts.py) and what the engine core receives (inputs.py); prompts given as
input embeddings ride the same items (prompt_embeds.py).
Below the engine and the models: imports only ferrox's errors. Imports stay lazy: PIL loads with media.py."""
