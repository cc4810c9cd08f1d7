"""The model families the worker runs, behind one interface.

- `interface.py`: `CausalLM`, what the runner and the CUDA graphs call (the forward in pieces around each
  layer's attention), and `WeightMap`, how the loader places a family's checkpoint tensors.
- `layers.py`: the shared layers (RMSNorm, rotary embeddings, attention, gated MLP) with their
  tensor-parallel split.
- `moe.py`: the mixture-of-experts feed-forward (router, top-k, stacked experts), split per expert.
- `llama.py`, `mistral.py`, `qwen2.py`, `qwen3.py`, `phi3.py`, `gemma2.py`, `gemma3.py`, `mixtral.py`,
  `qwen3_moe.py`, `qwen2_moe.py`: one file per family, with its config quirks.
- `quantization.py`, `fp8_linear.py`: quantized checkpoints' `quantization_config` (FP8 weights) and the
  projection that runs them (FP8 products on Hopper, dequantized elsewhere).
- `registry.py`: the families by config.json `architectures` / `model_type`, and `build_model`.

docs/models.md says how to add a family.
"""
