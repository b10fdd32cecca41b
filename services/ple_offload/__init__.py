"""The PLE offload service: one host-RAM copy of an n-gram embedding table per machine."""
