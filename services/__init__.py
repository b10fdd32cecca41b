"""vLLM Backport: an OpenAI-compatible serving mesh over gRPC for older NVIDIA cards."""
