"""`ito-training`: run the services (`serve`, `up`, `down`) and operate them (`accounts`,
`simulate-booking`). Operator tooling, not a service: it imports services only to start them, and
the embedded stack (`devstack/`) to start one."""
