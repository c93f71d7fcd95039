"""Deployment: Jinja2 templates for Kubernetes, Kubeflow TFJob, docker-compose and Marathon."""
