"""The model: the transformer and its config (one `ModelConfig`, family flags), attention
(`attention/`: a kernel per module, the dense oracle beside them), Gated DeltaNet layers,
checkpoint import/export (`hf.py`, `hf_qwen35.py`, `gguf.py`) and PEFT adapters (`lora.py`).
A new model family is its flags in config.py and its weight names in hf.py. Imports nothing
of branch_replay (but gguf.py: a GGUF's chat template as `branch_replay.data.chat`'s type)."""
