"""OpenAI embeddings: POST /v1/embeddings (request models in server/protocol.py)."""
