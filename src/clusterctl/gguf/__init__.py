"""GGUF import (`clusterctl model import`): a GGUF file read (reader.py) and checked (check.py), its tensors mapped
to an mlx-lm checkpoint (plan.py) with its tokenizer (tokenizer.py), written by importer.py. docs/models.md."""
