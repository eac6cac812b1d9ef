"""Running the apps: the launcher, the deployment and its roles, processes, the SuperLink, the flwr CLI, Ray
clusters."""
