"""One folder an API family: its request models (protocol.py), its route
(route.py) and what only it renders (render.py, relay.py). What several APIs
share stays flat in server/: errors, generation, relay, sse, render, tools,
validation, the chat protocol (protocol.py)."""
