"""The real engine: a Llama-family model with a paged KV cache, driven by the same
``EngineCore``, scheduler and policies as the simulator."""
