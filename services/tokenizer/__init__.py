"""The tokenizer service: chat rendering, encoding and streaming detokenization over gRPC."""
