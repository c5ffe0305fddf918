"""The OpenAI-compatible HTTP surface: its routes, serving them with uvicorn, and their guard.

``routes``: the FastAPI app (/v1/completions, /v1/chat/completions, /v1/models, /health,
/metrics); ``tokenize_routes``: vLLM's /tokenize, /detokenize and /tokenizer_info (over
``router.tokenize``); ``listen``: uvicorn as a task on the router's loop, on the bound socket,
over TLS when configured; ``guard``: the ASGI layer for the API key and the body cap;
``openai_requests`` / ``openai_responses``: OpenAI's request models and response bodies;
``prompt_batch``: a completions request with a batch of prompts, merged into one response.

Import from the modules themselves; this file imports nothing (fastapi loads only when HTTP is
served).
"""
