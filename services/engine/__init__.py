"""The engine service: gRPC over vLLM's AsyncLLM, token ids in and out."""
