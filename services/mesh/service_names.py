"""The mesh's gRPC services by their full proto names: what a server registers its handlers
and health status under, and what a health check asks about."""

from backport.v1 import engine_pb2, ple_pb2, tokenizer_pb2

TOKENIZER_GRPC = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name
ENGINE_GRPC = engine_pb2.DESCRIPTOR.services_by_name["Engine"].full_name
PLE_GRPC = ple_pb2.DESCRIPTOR.services_by_name["PleOffload"].full_name
