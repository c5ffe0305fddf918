"""The model runtime both workers share: model config, weight loading, the Llama-family forward
over a paged KV cache, block manager, scheduler, sampler, tokenizer, request state, the step.

Import the modules themselves: this file imports nothing, so the torch-free ones (``errors``,
``tokenizer``, ``request``, ``block_manager``, ``config``, ``settings``, ``model_files``) stay
torch-free to import (the router and the config use them).
"""
