"""ito-training services. Each subpackage is one service; they share only `contracts` and the
small `services.runtime` (settings, connections, codec, embedded infra). No service imports another."""
