/*
 * The C half of actorpipe's libfabric binding (feature `efa`).
 *
 * libfabric's data-path calls (fi_tsend, fi_cq_read, fi_close, ...) are `static inline` in its
 * headers: they jump through per-object operation tables. They cannot be called from Rust
 * without either replicating those tables' layouts or compiling them here. This file compiles
 * them, and keeps every libfabric struct on the C side: Rust only sees opaque pointers, plain
 * integers and the small `ap_*` structs below (mirrored in src/backend/efa/ffi.rs).
 *
 * Every function returns 0 or a positive count on success and a negative libfabric error code
 * (-FI_EAGAIN, -FI_ENODATA, ...) on failure, as libfabric itself does.
 */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
#include <rdma/fi_tagged.h>

/* One completion, success or error (mirrored in ffi.rs as ApCompletion). */
struct ap_completion {
	uint64_t context; /* the op_context given to the post */
	uint64_t tag;
	uint64_t len;
	uint64_t flags;
	uint64_t data;      /* the remote CQ data, where flags has FI_REMOTE_CQ_DATA; else 0 */
	int32_t err;        /* 0, or a positive FI_E* code */
	int32_t prov_errno; /* provider-specific code when err != 0 */
};

/* What the rest of the code needs to know of one fi_info entry (ApInfo in ffi.rs). */
struct ap_info {
	const char *provider;
	const char *fabric;
	const char *domain;
	uint64_t max_msg_size;
	uint64_t inject_size;
	uint64_t tx_size;
	uint64_t rx_size;
	uint64_t mr_mode;
	uint64_t mode;
	uint64_t caps;
	uint32_t addr_format;
	uint32_t pad;
};

uint32_t ap_version(void) { return fi_version(); }
uint32_t ap_header_version(void) { return FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION); }
const char *ap_strerror(int err) { return fi_strerror(err); }

/* RDM endpoints with tagged messages, for provider `prov` (NULL: any); with `inject` > 0,
 * only those that can inject (fi_tinject) at least that many bytes; with `rma`, only those
 * that also read and write registered memory of their peers (FI_RMA, remote memory). */
int ap_getinfo(const char *prov, size_t inject, int rma, struct fi_info **out)
{
	struct fi_info *hints = fi_allocinfo();
	int ret;
	if (!hints)
		return -FI_ENOMEM;
	hints->ep_attr->type = FI_EP_RDM;
	hints->caps = FI_TAGGED | FI_MSG;
	if (rma)
		hints->caps |= FI_RMA | FI_READ | FI_WRITE | FI_REMOTE_READ | FI_REMOTE_WRITE;
	/* We can hand every provider the scratch space it may ask for in op_context. */
	hints->mode = FI_CONTEXT | FI_CONTEXT2;
	/* The registration rules we honour (see docs/efa.md). FI_MR_ENDPOINT is not offered:
	 * providers that need it are not listed. */
	hints->domain_attr->mr_mode =
		FI_MR_LOCAL | FI_MR_VIRT_ADDR | FI_MR_ALLOCATED | FI_MR_PROV_KEY;
	hints->domain_attr->threading = FI_THREAD_DOMAIN;
	hints->tx_attr->inject_size = inject;
	/* The efa stream's credits ride remote CQ data (at most 31: 4 bytes, efa's size, is
	 * plenty). */
	hints->domain_attr->cq_data_size = 4;
	if (prov) {
		hints->fabric_attr->prov_name = strdup(prov);
		if (!hints->fabric_attr->prov_name) {
			fi_freeinfo(hints);
			return -FI_ENOMEM;
		}
	}
	ret = fi_getinfo(FI_VERSION(FI_MAJOR_VERSION, FI_MINOR_VERSION), NULL, NULL, 0, hints, out);
	fi_freeinfo(hints);
	return ret;
}

void ap_freeinfo(struct fi_info *info) { fi_freeinfo(info); }
/* A copy of one entry (not of the entries after it), freed with ap_freeinfo; NULL when out of
 * memory. An endpoint keeps one to open further endpoints on its domain later. */
struct fi_info *ap_dupinfo(const struct fi_info *info) { return fi_dupinfo(info); }
struct fi_info *ap_info_next(struct fi_info *info) { return info->next; }

void ap_info_read(const struct fi_info *info, struct ap_info *out)
{
	memset(out, 0, sizeof(*out));
	out->provider = info->fabric_attr ? info->fabric_attr->prov_name : NULL;
	out->fabric = info->fabric_attr ? info->fabric_attr->name : NULL;
	out->domain = info->domain_attr ? info->domain_attr->name : NULL;
	out->max_msg_size = info->ep_attr ? info->ep_attr->max_msg_size : 0;
	out->inject_size = info->tx_attr ? info->tx_attr->inject_size : 0;
	out->tx_size = info->tx_attr ? info->tx_attr->size : 0;
	out->rx_size = info->rx_attr ? info->rx_attr->size : 0;
	out->mr_mode = info->domain_attr ? (uint64_t)info->domain_attr->mr_mode : 0;
	out->mode = info->mode;
	out->caps = info->caps;
	out->addr_format = info->addr_format;
}

int ap_fabric(struct fi_info *info, struct fid_fabric **out)
{
	return fi_fabric(info->fabric_attr, out, NULL);
}

int ap_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **out)
{
	return fi_domain(fabric, info, out, NULL);
}

/* A tagged-format CQ; with `want_fd`, one with a wait fd (written to *fd), else none (*fd = -1).
 * Returns -FI_ENOSYS (or the provider's refusal) when a wait fd is not available. */
int ap_cq_open(struct fid_domain *domain, size_t size, int want_fd, struct fid_cq **out, int *fd)
{
	struct fi_cq_attr attr;
	int ret;
	memset(&attr, 0, sizeof(attr));
	attr.size = size;
	attr.format = FI_CQ_FORMAT_TAGGED;
	attr.wait_obj = want_fd ? FI_WAIT_FD : FI_WAIT_NONE;
	*fd = -1;
	ret = fi_cq_open(domain, &attr, out, NULL);
	if (ret)
		return ret;
	if (want_fd) {
		ret = fi_control(&(*out)->fid, FI_GETWAIT, fd);
		if (ret) {
			fi_close(&(*out)->fid);
			*out = NULL;
			*fd = -1;
			return ret;
		}
	}
	return 0;
}

int ap_av_open(struct fid_domain *domain, struct fid_av **out)
{
	struct fi_av_attr attr;
	memset(&attr, 0, sizeof(attr));
	attr.type = FI_AV_TABLE;
	return fi_av_open(domain, &attr, out, NULL);
}

/* An enabled RDM endpoint bound to one CQ (sends and receives) and one AV. Several endpoints
 * may share one CQ and one AV: a read of the CQ progresses every endpoint bound to it, and an
 * fi_addr_t of the AV names the same peer on each. */
int ap_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_cq *cq,
		struct fid_av *av, struct fid_ep **out)
{
	int ret = fi_endpoint(domain, info, out, NULL);
	if (ret)
		return ret;
	ret = fi_ep_bind(*out, &cq->fid, FI_TRANSMIT | FI_RECV);
	if (!ret)
		ret = fi_ep_bind(*out, &av->fid, 0);
	if (!ret)
		ret = fi_enable(*out);
	if (ret) {
		fi_close(&(*out)->fid);
		*out = NULL;
	}
	return ret;
}

int ap_getname(struct fid_ep *ep, void *addr, size_t *len) { return fi_getname(&ep->fid, addr, len); }

/* Inserts one address; returns its fi_addr_t in *out. */
int ap_av_insert(struct fid_av *av, const void *addr, uint64_t *out)
{
	fi_addr_t a = FI_ADDR_UNSPEC;
	int ret = fi_av_insert(av, addr, 1, &a, 0, NULL);
	if (ret == 1) {
		*out = a;
		return 0;
	}
	return ret < 0 ? ret : -FI_EINVAL;
}

int ap_av_remove(struct fid_av *av, uint64_t addr)
{
	fi_addr_t a = addr;
	return fi_av_remove(av, &a, 1, 0);
}

int ap_close_ep(struct fid_ep *p) { return fi_close(&p->fid); }
int ap_close_cq(struct fid_cq *p) { return fi_close(&p->fid); }
int ap_close_av(struct fid_av *p) { return fi_close(&p->fid); }
int ap_close_mr(struct fid_mr *p) { return fi_close(&p->fid); }
int ap_close_domain(struct fid_domain *p) { return fi_close(&p->fid); }
int ap_close_fabric(struct fid_fabric *p) { return fi_close(&p->fid); }

/* With `data` non-zero, the message carries it as remote CQ data (fi_tsenddata). */
ssize_t ap_tsend(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t dest,
		 uint64_t tag, uint64_t data, void *context)
{
	if (data)
		return fi_tsenddata(ep, buf, len, desc, data, dest, tag, context);
	return fi_tsend(ep, buf, len, desc, dest, tag, context);
}

/* A tagged send of at most the inject size: the buffer is free on return and no completion
 * is generated. With `data` non-zero, as ap_tsend. */
ssize_t ap_tinject(struct fid_ep *ep, const void *buf, size_t len, uint64_t dest, uint64_t tag,
		   uint64_t data)
{
	if (data)
		return fi_tinjectdata(ep, buf, len, data, dest, tag);
	return fi_tinject(ep, buf, len, dest, tag);
}

ssize_t ap_trecv(struct fid_ep *ep, void *buf, size_t len, void *desc, uint64_t src,
		 uint64_t tag, uint64_t ignore, void *context)
{
	return fi_trecv(ep, buf, len, desc, src, tag, ignore, context);
}

ssize_t ap_cancel(struct fid_ep *ep, void *context) { return fi_cancel(&ep->fid, context); }

/*
 * Reads up to `count` completions into `out`. An error completion comes back as one entry
 * with `err` set (and its text in `errbuf`), after the successes read before it.
 * Returns how many entries were written, 0 when the CQ is empty, or a negative error.
 */
ssize_t ap_cq_read(struct fid_cq *cq, struct ap_completion *out, size_t count, char *errbuf,
		   size_t errlen)
{
	struct fi_cq_tagged_entry entries[64];
	struct fi_cq_err_entry e;
	ssize_t n, i;
	if (count > 64)
		count = 64;
	n = fi_cq_read(cq, entries, count);
	if (n > 0) {
		for (i = 0; i < n; i++) {
			out[i].context = (uint64_t)(uintptr_t)entries[i].op_context;
			out[i].tag = entries[i].tag;
			out[i].len = entries[i].len;
			out[i].flags = entries[i].flags;
			out[i].data = entries[i].flags & FI_REMOTE_CQ_DATA ? entries[i].data : 0;
			out[i].err = 0;
			out[i].prov_errno = 0;
		}
		return n;
	}
	if (n == -FI_EAGAIN)
		return 0;
	if (n != -FI_EAVAIL)
		return n;
	memset(&e, 0, sizeof(e));
	n = fi_cq_readerr(cq, &e, 0);
	if (n == -FI_EAGAIN)
		return 0;
	if (n < 0)
		return n;
	out[0].context = (uint64_t)(uintptr_t)e.op_context;
	out[0].tag = e.tag;
	out[0].len = e.len;
	out[0].flags = e.flags;
	out[0].data = 0;
	out[0].err = e.err ? e.err : FI_EOTHER;
	out[0].prov_errno = e.prov_errno;
	if (errbuf && errlen) {
		const char *s = fi_cq_strerror(cq, e.prov_errno, e.err_data, errbuf, errlen);
		if (s && s != errbuf)
			snprintf(errbuf, errlen, "%s", s);
	}
	return 1;
}

/* 0 when it is safe to block on the CQ's wait fd; -FI_EAGAIN when the CQ must be read first. */
int ap_trywait(struct fid_fabric *fabric, struct fid_cq *cq)
{
	struct fid *fids[1] = { &cq->fid };
	return fi_trywait(fabric, fids, 1);
}

int ap_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access,
	      struct fid_mr **out, void **desc)
{
	/* Providers without FI_MR_PROV_KEY take the key we request and refuse a second live
	 * registration with the same one (-FI_ENOKEY): every registration asks for a new one. */
	static uint64_t next_key;
	uint64_t key = __atomic_fetch_add(&next_key, 1, __ATOMIC_RELAXED);
	int ret = fi_mr_reg(domain, buf, len, access, 0, key, 0, out, NULL);
	if (ret)
		return ret;
	*desc = fi_mr_desc(*out);
	return 0;
}

/* The key a peer names registration `mr` by in its RMA operations. */
uint64_t ap_mr_key(struct fid_mr *mr) { return fi_mr_key(mr); }

/* Reads `len` bytes of the peer `src`'s registration `key` at `addr` into `buf` (fi_read): the
 * completion says they are in `buf`. */
ssize_t ap_read(struct fid_ep *ep, void *buf, size_t len, void *desc, uint64_t src,
		uint64_t addr, uint64_t key, void *context)
{
	return fi_read(ep, buf, len, desc, src, addr, key, context);
}

/* Writes `len` bytes at `buf` into the peer `dest`'s registration `key` at `addr`. Delivery
 * complete: the completion comes once the bytes are in the target's memory, not merely sent
 * (a remote write's completion says its bytes are visible to the region's owner). */
ssize_t ap_write(struct fid_ep *ep, const void *buf, size_t len, void *desc, uint64_t dest,
		 uint64_t addr, uint64_t key, void *context)
{
	struct iovec iov = { .iov_base = (void *)buf, .iov_len = len };
	struct fi_rma_iov rma = { .addr = addr, .len = len, .key = key };
	struct fi_msg_rma msg = {
		.msg_iov = &iov,
		.desc = &desc,
		.iov_count = 1,
		.addr = dest,
		.rma_iov = &rma,
		.rma_iov_count = 1,
		.context = context,
		.data = 0,
	};
	return fi_writemsg(ep, &msg, FI_DELIVERY_COMPLETE | FI_COMPLETION);
}

/* libfabric constants the Rust side needs, so no number is copied by hand. */
uint64_t ap_const(int which)
{
	switch (which) {
	case 0: return FI_EAGAIN;
	case 1: return FI_MR_LOCAL;
	case 2: return FI_MR_HMEM;
	case 3: return FI_ADDR_UNSPEC;
	case 4: return FI_SEND;
	case 5: return FI_RECV;
	case 6: return FI_ECANCELED;
	case 7: return FI_ENODATA;
	case 8: return FI_ETRUNC;
	case 9: return FI_EIO;
	case 10: return FI_ADDR_STR;
	case 11: return FI_ENOMEM;
	case 12: return FI_RMA;
	case 13: return FI_MR_VIRT_ADDR;
	case 14: return FI_READ;
	case 15: return FI_WRITE;
	case 16: return FI_REMOTE_READ;
	case 17: return FI_REMOTE_WRITE;
	default: return 0;
	}
}
