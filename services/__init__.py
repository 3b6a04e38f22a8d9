"""ito-training's services, one subpackage each: entitlement, confirmation, ledger, scheduler,
telemetry, desk and trainer. They speak NATS and Redis through `runtime`, apply the pure rules of
`domain`, exchange `contracts`, and the trainer trains with `training`. No service imports another."""
