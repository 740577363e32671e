/*
 * Reproduces two behaviours of libfabric's shm provider (1.17) that the efa backend works
 * around (docs/efa.md, "A dead peer's sends on `shm`"). Plain libfabric, no actorpipe code.
 *
 *   shm-stall stall SIZE MODE   three processes: the sender sends 8 messages of SIZE bytes to a
 *                               silent peer (it reads its CQ but posts no receive), kills it
 *                               (MODE kill) or not (MODE alive), then sends 64 to a live peer
 *                               that has posted receives for them, and counts the live peer's
 *                               receives and its own send completions. MODE split: as kill, the
 *                               sends to each peer on an endpoint of their own (one CQ, one AV).
 *   shm-stall reuse [split]     one process: a message to a peer, fi_av_remove of that peer,
 *                               then a message to a new peer given the freed fi_addr_t (which
 *                               numbers the sender differently from the first); split: sent
 *                               from a second endpoint on the same CQ and AV.
 *
 * Run by scripts/shm-stall.sh. FI_SHM_DISABLE_CMA=1 selects the bounce-buffer protocol.
 */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_tagged.h>

#define CHECK(x)                                                                           \
	do {                                                                               \
		int r_ = (int)(x);                                                         \
		if (r_ < 0) {                                                              \
			fprintf(stderr, "%d: %s: %s\n", getpid(), #x, fi_strerror(-r_));  \
			exit(2);                                                           \
		}                                                                          \
	} while (0)

/* One domain with one CQ and one AV, and up to two endpoints bound to both. */
struct node {
	struct fi_info *info;
	struct fid_fabric *fabric;
	struct fid_domain *domain;
	struct fid_cq *cq;
	struct fid_av *av;
	struct fid_ep *ep, *ep2;
	char name[256];
	int sends, recvs;
};

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec * 1e-9;
}

static struct fid_ep *endpoint(struct node *n)
{
	struct fid_ep *ep;
	CHECK(fi_endpoint(n->domain, n->info, &ep, NULL));
	CHECK(fi_ep_bind(ep, &n->cq->fid, FI_TRANSMIT | FI_RECV));
	CHECK(fi_ep_bind(ep, &n->av->fid, 0));
	CHECK(fi_enable(ep));
	return ep;
}

static void open_node(struct node *n, int two)
{
	struct fi_info *hints = fi_allocinfo();
	struct fi_cq_attr cq = { .size = 4096, .format = FI_CQ_FORMAT_TAGGED };
	struct fi_av_attr av = { .type = FI_AV_TABLE };
	size_t len = sizeof(n->name);
	memset(n, 0, sizeof(*n));
	hints->ep_attr->type = FI_EP_RDM;
	hints->caps = FI_TAGGED | FI_MSG;
	hints->mode = FI_CONTEXT | FI_CONTEXT2;
	hints->domain_attr->threading = FI_THREAD_DOMAIN;
	hints->fabric_attr->prov_name = strdup("shm");
	CHECK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, hints, &n->info));
	fi_freeinfo(hints);
	CHECK(fi_fabric(n->info->fabric_attr, &n->fabric, NULL));
	CHECK(fi_domain(n->fabric, n->info, &n->domain, NULL));
	CHECK(fi_cq_open(n->domain, &cq, &n->cq, NULL));
	CHECK(fi_av_open(n->domain, &av, &n->av, NULL));
	n->ep = endpoint(n);
	n->ep2 = two ? endpoint(n) : n->ep;
	CHECK(fi_getname(&n->ep->fid, n->name, &len));
}

/* Reads the CQ once; counts send and receive completions. */
static void poll_cq(struct node *n)
{
	struct fi_cq_tagged_entry e[64];
	ssize_t r = fi_cq_read(n->cq, e, 64);
	if (r == -FI_EAVAIL) {
		struct fi_cq_err_entry err = { 0 };
		fi_cq_readerr(n->cq, &err, 0);
		fprintf(stderr, "%d: error completion: %s\n", getpid(), fi_strerror(err.err));
		return;
	}
	for (ssize_t i = 0; i < r; i++) {
		if (e[i].flags & FI_RECV)
			n->recvs++;
		else
			n->sends++;
	}
}

/* Sends, retrying -FI_EAGAIN (shm says it until the peer has taken our name, and while it is
 * out of room) for up to 2 s, reading `peer`'s CQ too where it is in this process; 0 if it
 * never went. */
static int send_to(struct node *n, struct fid_ep *ep, const void *buf, size_t len,
		   fi_addr_t to, uint64_t tag, struct fi_context2 *ctx, struct node *peer)
{
	double until = now() + 2;
	ssize_t r;
	while ((r = fi_tsend(ep, buf, len, NULL, to, tag, ctx)) == -FI_EAGAIN && now() < until) {
		poll_cq(n);
		if (peer)
			poll_cq(peer);
	}
	CHECK(r == -FI_EAGAIN ? 0 : r);
	return r == 0;
}

/* A child that opens an endpoint, tells the parent its name, optionally posts `recvs`
 * receives of `size` bytes (tags 100...), then reads its CQ until killed, writing its receive
 * count to `report` each time it grows. */
static pid_t child(int to_parent, int report, size_t size, int recvs)
{
	pid_t pid = fork();
	struct node n;
	if (pid)
		return pid;
	open_node(&n, 0);
	char *buf = malloc(size * (recvs ? recvs : 1));
	struct fi_context2 *ctx = calloc(recvs + 1, sizeof(*ctx));
	for (int i = 0; i < recvs; i++)
		CHECK(fi_trecv(n.ep, buf + i * size, size, NULL, FI_ADDR_UNSPEC, 100 + i, 0,
			       &ctx[i]));
	CHECK(write(to_parent, n.name, sizeof(n.name)));
	for (int told = 0;; usleep(50)) {
		poll_cq(&n);
		if (n.recvs > told) {
			CHECK(write(report, &n.recvs, sizeof(n.recvs)));
			told = n.recvs;
		}
	}
}

static int stall(size_t size, const char *mode)
{
	enum { SILENT = 8, LIVE = 64 };
	int split = !strcmp(mode, "split"), alive = !strcmp(mode, "alive");
	int names[2], report[2], got = -1, posted = 0;
	char silent_name[256], live_name[256];
	struct fi_context2 ctx[SILENT + LIVE];
	struct node a;
	fi_addr_t silent_at, live_at;
	CHECK(pipe(names));
	CHECK(pipe(report));
	pid_t silent = child(names[1], report[1], size, 0);
	CHECK(read(names[0], silent_name, sizeof(silent_name)));
	pid_t live = child(names[1], report[1], size, LIVE);
	CHECK(read(names[0], live_name, sizeof(live_name)));
	open_node(&a, split);
	CHECK(fi_av_insert(a.av, silent_name, 1, &silent_at, 0, NULL));
	CHECK(fi_av_insert(a.av, live_name, 1, &live_at, 0, NULL));
	char *buf = calloc(1, size);
	int silent_posted = 0;
	while (silent_posted < SILENT &&
	       send_to(&a, a.ep, buf, size, silent_at, 1, &ctx[silent_posted], NULL))
		silent_posted++;
	for (double until = now() + 0.1; now() < until;)
		poll_cq(&a);
	int silent_done = a.sends;
	if (!alive) {
		kill(silent, SIGKILL);
		waitpid(silent, NULL, 0);
	}
	while (posted < LIVE &&
	       send_to(&a, a.ep2, buf, size, live_at, 100 + posted, &ctx[SILENT + posted],
			   NULL))
		posted++;
	for (double until = now() + 2; now() < until && a.sends < silent_done + posted;)
		poll_cq(&a);
	usleep(200 * 1000);
	CHECK(fcntl(report[0], F_SETFL, O_NONBLOCK));
	for (int last; read(report[0], &last, sizeof(last)) == sizeof(last);)
		got = last;
	printf("%-8zu %-6s cma %-3s  to the silent peer: %d/%d posted, %d completed; to the live "
	       "peer: %d/%d posted, %d received, %d completed\n",
	       size, mode, getenv("FI_SHM_DISABLE_CMA") ? "off" : "on", silent_posted, SILENT,
	       silent_done, posted, LIVE, got < 0 ? 0 : got, a.sends - silent_done);
	kill(live, SIGKILL);
	kill(silent, SIGKILL);
	while (wait(NULL) > 0)
		;
	return 0;
}

/* Moves one message of 64 KiB from `from` (on `ep`) to `to`, for up to 2 s. */
static void one_message(struct node *from, struct fid_ep *ep, fi_addr_t at, struct node *to,
			const char *what)
{
	static char out[65536], in[65536];
	struct fi_context2 s, r;
	int sends = from->sends, recvs = to->recvs;
	CHECK(fi_trecv(to->ep, in, sizeof(in), NULL, FI_ADDR_UNSPEC, 9, 0, &r));
	send_to(from, ep, out, sizeof(out), at, 9, &s, to);
	for (double until = now() + 2;
	     now() < until && (from->sends == sends || to->recvs == recvs);) {
		poll_cq(from);
		poll_cq(to);
	}
	printf("%s: received %d, send completed %d\n", what, to->recvs - recvs,
	       from->sends - sends);
}

static int reuse(int split)
{
	struct node a, first, next;
	fi_addr_t at, back, unrelated;
	open_node(&a, split);
	open_node(&first, 0);
	open_node(&next, 0);
	CHECK(fi_av_insert(a.av, first.name, 1, &at, 0, NULL));
	CHECK(fi_av_insert(first.av, a.name, 1, &back, 0, NULL));
	one_message(&a, a.ep2, at, &first, "to the first peer");
	CHECK(fi_av_remove(a.av, &at, 1, 0));
	CHECK(fi_av_insert(a.av, next.name, 1, &at, 0, NULL));
	/* The new peer knows another endpoint first: it numbers the sender 1, the first 0. */
	CHECK(fi_av_insert(next.av, first.name, 1, &unrelated, 0, NULL));
	CHECK(fi_av_insert(next.av, a.name, 1, &back, 0, NULL));
	printf("the new peer at fi_addr %lu, as the first was; it numbers the sender %lu\n",
	       (unsigned long)at, (unsigned long)back);
	fflush(stdout);
	one_message(&a, a.ep2, at, &next, "to the new peer");
	return 0;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IOLBF, 0);
	if (argc >= 4 && !strcmp(argv[1], "stall"))
		return stall(strtoul(argv[2], NULL, 0), argv[3]);
	if (argc >= 2 && !strcmp(argv[1], "reuse"))
		return reuse(argc > 2 && !strcmp(argv[2], "split"));
	fprintf(stderr, "usage: %s stall SIZE kill|alive|split | reuse [split]\n", argv[0]);
	return 1;
}
