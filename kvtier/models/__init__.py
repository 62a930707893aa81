"""Model code: the Llama-family model, its config, checkpoint loading, tokenizer and chat
template. Knows nothing of pools' owners, tiers or the engine loop."""
