"""OpenAI Responses: POST /v1/responses and the stored responses (GET, DELETE, input_items)."""
