/* SPDX-License-Identifier: Apache-2.0 */
/* Client._list(), _channel_list() and stat(): what the daemon holds, as Python data. */
#include <stdio.h>
#include <stdlib.h>

#include "dlpack_ipc.h"

/* An entry's device as dlpackctl says it ("cpu", "cuda:N" with the publisher's ordinal, or
 * "other"), into @p buf. */
void ipc_device_text(DLDevice dev, char *buf, size_t len)
{
	if (dev.device_type == kDLCPU)
		snprintf(buf, len, "cpu");
	else if (dev.device_type == kDLCUDA)
		snprintf(buf, len, "cuda:%d", (int)dev.device_id);
	else
		snprintf(buf, len, "other");
}

static PyObject *entry_dict(const dlpc_entry_info *e)
{
	PyObject *tensors = PyList_New(0), *d;
	char device[32];

	for (size_t i = 0; tensors && e->tensors && i < e->ntensors; i++) {
		const dlpc_tensor_info *t = &e->tensors[i];
		PyObject *shape = PyTuple_New(t->ndim), *dtype = ipc_dtype_name(t->dtype), *item;

		for (int32_t k = 0; shape && k < t->ndim; k++) {
			PyObject *extent = PyLong_FromLongLong(t->shape[k]);

			if (!extent || PyTuple_SetItem(shape, k, extent) < 0)
				Py_CLEAR(shape);
		}
		item = shape && dtype ? Py_BuildValue("(sOO)", t->key, dtype, shape) : NULL;
		if (!item || PyList_Append(tensors, item) < 0)
			Py_CLEAR(tensors);
		Py_XDECREF(item);
		Py_XDECREF(shape);
		Py_XDECREF(dtype);
	}
	if (!tensors)
		return NULL;
	ipc_device_text(e->device, device, sizeof(device));
	d = Py_BuildValue("{s:s,s:K,s:s,s:N,s:n,s:K,s:K,s:K,s:I,s:i,s:d,s:L,s:I}", "name", e->name,
			  "generation", (unsigned long long)e->generation, "device", device,
			  "tensors", tensors, "ntensors", (Py_ssize_t)e->ntensors, "nbytes",
			  (unsigned long long)e->nbytes, "refs", (unsigned long long)e->refs,
			  "cached_refs", (unsigned long long)e->cached_refs, "uid", e->owner_uid,
			  "pid", e->owner_pid, "created", e->created_ns / 1e9, "created_ns",
			  (long long)e->created_ns, "flags", e->flags);
	return d;
}

/* Why DLPC_CHANNEL_PREFER_DIRECT (Channel's direct=None) made a channel queued; NULL if it
 * did not. */
static const char *fallback_why(uint32_t flags)
{
	if (flags & DLPC_CHANNEL_FALLBACK_CAPACITY)
		return "a direct channel cannot queue that many messages here (the kernel's "
		       "socket buffer limit, net.core.wmem_max), so it was made queued";
	if (flags & DLPC_CHANNEL_FALLBACK_FDS)
		return "dlpackd's fd limit or this uid's fd share (--max-fd-share-per-uid) had no "
		       "room for a direct channel's two sockets, or dlpackd could not make them, "
		       "so it was made queued";
	return NULL;
}

PyObject *ipc_channel_dict(const dlpc_channel_info *i)
{
	return Py_BuildValue(
		"{s:s,s:I,s:I,s:K,s:K,s:K,s:I,s:I,s:I,s:i,s:d,s:O,s:O,s:I,s:I,s:I,"
		"s:z}",
		"name", i->name, "capacity", i->capacity, "depth", i->depth, "bytes_queued",
		(unsigned long long)i->bytes_queued, "sent", (unsigned long long)i->sent,
		"received", (unsigned long long)i->received, "receivers_waiting",
		i->receivers_waiting, "senders_waiting", i->senders_waiting, "uid", i->owner_uid,
		"pid", i->owner_pid, "created", i->created_ns / 1e9, "direct",
		(i->flags & DLPC_CHANNEL_DIRECT) ? Py_True : Py_False, "ended",
		(i->flags & DLPC_CHANNEL_ENDED) ? Py_True : Py_False, "producers", i->producers,
		"producers_closed", i->producers_closed, "producers_expected",
		i->producers_expected, "fallback", fallback_why(i->flags));
}

/* _list() (LIST) or, @p channels, _channel_list() (LIST of channels): a list of dicts. */
static PyObject *list_call(PyObject *obj, PyObject *args, PyObject *kwargs, bool channels)
{
	static char *kwlist[] = {"prefix", NULL};
	const char *prefix = "";
	dlpc_channel_info *cv = NULL;
	dlpc_entry_info *ev = NULL;
	PyObject *list;
	size_t n = 0;
	int r;

	if (!PyArg_ParseTupleAndKeywords(args, kwargs, channels ? "|s:_channel_list" : "|s:list",
					 kwlist, &prefix))
		return NULL;
	IPC_CALL((ClientObject *)obj, c, r,
		 channels ? dlpc_channel_list(c, prefix, &cv, &n) : dlpc_list(c, prefix, &ev, &n));
	if (r < 0)
		return ipc_raise(r);
	list = PyList_New((Py_ssize_t)n);
	for (size_t i = 0; list && i < n; i++) {
		PyObject *d = channels ? ipc_channel_dict(&cv[i]) : entry_dict(&ev[i]);

		if (!d || PyList_SetItem(list, (Py_ssize_t)i, d) < 0) /* steals d */
			Py_CLEAR(list);
	}
	if (channels)
		free(cv);
	else
		dlpc_list_free(ev, n);
	return list;
}

PyObject *ipc_client_list(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	return list_call(obj, args, kwargs, false);
}

PyObject *ipc_client_channel_list(PyObject *obj, PyObject *args, PyObject *kwargs)
{
	return list_call(obj, args, kwargs, true);
}

/* The counters past what one Py_BuildValue() takes (channels, the fd budget) added to the STAT
 * dict @p d; @p d or NULL. */
static PyObject *add_more_stats(PyObject *d, const dlpc_stats *s)
{
	const struct {
		const char *key;
		uint64_t v;
	} f[] = {
		{"channels", s->channels},	   {"messages", s->messages},
		{"req_send", s->req_send},	   {"req_recv", s->req_recv},
		{"req_channel", s->req_channel},   {"req_cancel", s->req_cancel},
		{"uid_channels", s->uid_channels}, {"fd_budget", s->fd_budget},
		{"fds_own", s->fds_own},
	};

	for (size_t i = 0; d && i < sizeof(f) / sizeof(f[0]); i++) {
		PyObject *v = PyLong_FromUnsignedLongLong(f[i].v);

		if (!v || PyDict_SetItemString(d, f[i].key, v) < 0)
			Py_CLEAR(d);
		Py_XDECREF(v);
	}
	return d;
}

PyObject *ipc_client_stat(PyObject *obj, PyObject *unused)
{
	dlpc_stats s = {.size = sizeof(s)};
	int r;

	(void)unused;
	IPC_CALL((ClientObject *)obj, c, r, dlpc_stat(c, &s));
	if (r < 0)
		return ipc_raise(r);
	return add_more_stats(
		Py_BuildValue(
			"{s:I,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,"
			"s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}",
			"daemon_pid", s.daemon_pid, "uptime_ms", s.uptime_ms, "connections",
			s.connections, "entries", s.entries, "storages", s.storages, "bytes_held",
			s.bytes_held, "references", s.references, "waiters", s.waiters, "fds_open",
			s.fds_open, "fds_sent", s.fds_sent, "req_hello", s.req_hello, "req_publish",
			s.req_publish, "req_attach", s.req_attach, "req_release", s.req_release,
			"req_unpublish", s.req_unpublish, "req_list", s.req_list, "req_stat",
			s.req_stat, "protocol_errors", s.protocol_errors, "fds_closing",
			s.fds_closing, "req_watch", s.req_watch, "watchers", s.watchers, "events",
			s.events, "tx_queued", s.tx_queued, "queue_drops", s.queue_drops,
			"uid_bytes_held", s.uid_bytes_held, "uid_entries", s.uid_entries,
			"uid_connections", s.uid_connections, "uid_bytes_pinned",
			s.uid_bytes_pinned, "cached_references", s.cached_references,
			"invalidations", s.invalidations),
		&s);
}
