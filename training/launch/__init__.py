"""How a stage's ranks start: torch's elastic launcher on one node, a node's share of a multi-node run, one rank's entry, the authenticated rendezvous."""
