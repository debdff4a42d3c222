"""OpenAI completions: POST /v1/completions (request models in server/protocol.py)."""
