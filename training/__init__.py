"""The torch training library: the model, data, weights in and out, the engine every recipe uses,
the recipes, and how a stage's ranks start. It runs inside torchrun ranks, under the trainer service
(services/trainer) and under bench/. It imports torch, `contracts`, `domain` and the runtime's
storage and security rooms, never `runtime.messaging`, a NATS or Redis client, or a service."""
