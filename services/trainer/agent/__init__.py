"""The trainer agent: the service (app, worker), its run events, meter, storage check and a follower node's decisions."""
