"""OpenAI chat completions: POST /v1/chat/completions (request models in server/protocol.py)."""
