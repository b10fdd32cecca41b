"""Tests and fidelity harness for the Triton kernels in services/engine/backport/kernels."""
