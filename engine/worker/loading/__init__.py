"""Model loading: finding a named model's files (model_files.py: a hub id, a folder, a GGUF file's
cached folder, a GGUF on the hub by its quantization (hub_reference.py), the embedded default),
reading its checkpoint (checkpoint.py, gguf_file.py, gguf_split.py), its tokenizer, and choosing
how a quantized file's weights run (quantization_choice.py). Nothing here runs a step."""
