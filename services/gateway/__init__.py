"""The OpenAI-compatible gateway: FastAPI over the tokenizer and engine services. Imports no torch or vllm."""
