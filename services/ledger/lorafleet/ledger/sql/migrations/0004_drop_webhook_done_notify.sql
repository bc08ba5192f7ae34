-- lorafleet_webhook_done was notified when a delivery ended for good, but no replica listens on
-- it (notifications.py subscribes to lorafleet_work, lorafleet_lease_ended,
-- lorafleet_job_event and lorafleet_webhook): only a test did. Production schema carries no
-- test hooks; a test that needs one installs it in its own database.

DROP TRIGGER webhook_deliveries_done ON webhook_deliveries;
DROP FUNCTION lorafleet_notify_webhook_done();
