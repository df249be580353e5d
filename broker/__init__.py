"""Broker core: settings, the embedded NATS launcher, stream provisioning and call publishing.

Admission policy and state (sessions, tenants, Redis) also belong here; see the admission issue.
"""
