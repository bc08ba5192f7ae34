-- The W3C traceparent of the lease's grant span, recorded before the grant is sent: a worker
-- that resumes the lease after a reconnect (on any replica) gets the scheduler's spans for it
-- under that grant again, as the worker's own spans are. NULL: a lease granted before this.
ALTER TABLE leases ADD COLUMN traceparent text;
