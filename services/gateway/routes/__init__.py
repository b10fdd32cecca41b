"""HTTP routes; each module declares one router."""
