"""The KV-cache service: LMCache's server, configured and supervised for the mesh."""
