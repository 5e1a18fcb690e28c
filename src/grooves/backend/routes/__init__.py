"""The service's HTTP routes, one module per part of the Tinker API; ``grooves.backend.app`` mounts them."""
