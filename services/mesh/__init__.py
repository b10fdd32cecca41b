"""Plumbing every service shares: settings, logging, the gRPC server lifecycle and channels."""
