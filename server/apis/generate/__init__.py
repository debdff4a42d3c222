"""vLLM's and TGI's generate APIs: POST /generate, /generate_stream and / (TGI)."""
