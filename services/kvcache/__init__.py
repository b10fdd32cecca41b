"""The KV-cache service: LMCache's server, configured and supervised for the mesh."""

# The read end of the pipe whose write end only the KV runner holds (`services.mesh.lifeline`):
# LMCache's server stops once the runner is gone. Here, so that the runner and the server
# (which imports nothing of the project's dependencies) read one name.
RUNNER_LIFELINE_FD_ENV = "BACKPORT_KVCACHE_RUNNER_LIFELINE_FD"
