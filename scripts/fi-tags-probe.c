/*
 * What libfabric reports for a received tagged message, with and without rxm's passthru: the
 * tag, the remote CQ data and the flags of a receive posted with the credits field ignored, for
 * fi_tsend, fi_tinject, fi_tsenddata and fi_tinjectdata of 96 bytes between two endpoints of one
 * process (docs/efa-measurements.md, "The spin's `sched_yield` again, and rxm's passthru").
 * Build and run (needs libfabric-dev):
 *   gcc -O1 -o /tmp/fi-tags scripts/fi-tags-probe.c $(pkg-config --cflags --libs libfabric)
 *   /tmp/fi-tags 'tcp;ofi_rxm'; FI_OFI_RXM_ENABLE_PASSTHRU=1 /tmp/fi-tags 'tcp;ofi_rxm'
 */
#include <rdma/fabric.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_tagged.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_errno.h>
#include <stdio.h>
#include <string.h>
#include <stdlib.h>
#define CK(x) do { int _r = (x); if (_r) { fprintf(stderr, "%s: %d %s\n", #x, _r, fi_strerror(-_r)); exit(1);} } while (0)
struct side { struct fid_fabric *f; struct fid_domain *d; struct fid_ep *ep; struct fid_cq *cq; struct fid_av *av; };
static void open_side(struct fi_info *i, struct side *s) {
  struct fi_cq_attr ca = { .format = FI_CQ_FORMAT_TAGGED };
  struct fi_av_attr aa = { .type = FI_AV_TABLE };
  CK(fi_fabric(i->fabric_attr, &s->f, NULL)); CK(fi_domain(s->f, i, &s->d, NULL));
  CK(fi_cq_open(s->d, &ca, &s->cq, NULL)); CK(fi_av_open(s->d, &aa, &s->av, NULL));
  CK(fi_endpoint(s->d, i, &s->ep, NULL));
  CK(fi_ep_bind(s->ep, &s->cq->fid, FI_TRANSMIT | FI_RECV)); CK(fi_ep_bind(s->ep, &s->av->fid, 0));
  CK(fi_enable(s->ep));
}
int main(int argc, char **argv) {
  if (argc < 2) { fprintf(stderr, "usage: %s PROVIDER\n", argv[0]); return 2; }
  struct fi_info *h = fi_allocinfo(), *i;
  h->caps = FI_TAGGED | FI_MSG; h->ep_attr->type = FI_EP_RDM; h->mode = FI_CONTEXT;
  h->domain_attr->cq_data_size = 4;
  h->fabric_attr->prov_name = strdup(argv[1]);
  CK(fi_getinfo(FI_VERSION(1, 17), NULL, NULL, 0, h, &i));
  while (i && strcmp(i->domain_attr->name, "lo") && strcmp(i->fabric_attr->prov_name, "shm")) i = i->next;
  if (!i) { fprintf(stderr, "%s: no loopback domain\n", argv[1]); return 1; }
  printf("%s %s inject %zu cq_data %zu\n", i->fabric_attr->prov_name, i->domain_attr->name, i->tx_attr->inject_size, i->domain_attr->cq_data_size);
  struct side a, b; open_side(i, &a); open_side(i, &b);
  char name[256]; size_t len = sizeof name; fi_addr_t b_at_a, a_at_b;
  CK(fi_getname(&b.ep->fid, name, &len)); fi_av_insert(a.av, name, 1, &b_at_a, 0, NULL);
  len = sizeof name; CK(fi_getname(&a.ep->fid, name, &len)); fi_av_insert(b.av, name, 1, &a_at_b, 0, NULL);
  for (int round = 0; round < 4; round++) {
    char in[96], out[96]; memset(out, round, sizeof out); struct fi_context ctx[2];
    uint64_t posted = 0x1000 + round, sent = posted | (3ULL << 59);
    CK((int)fi_trecv(b.ep, in, sizeof in, NULL, a_at_b, posted, 0x1fULL << 59, &ctx[0]));
    ssize_t r;
    int inj = round & 1, data = round >= 2;
    do {
      if (data) r = inj ? fi_tinjectdata(a.ep, out, 96, 0xbeef, b_at_a, sent) : fi_tsenddata(a.ep, out, 96, NULL, 0xbeef, b_at_a, sent, &ctx[1]);
      else r = inj ? fi_tinject(a.ep, out, 96, b_at_a, sent) : fi_tsend(a.ep, out, 96, NULL, b_at_a, sent, &ctx[1]);
      struct fi_cq_tagged_entry e; fi_cq_read(a.cq, &e, 1); fi_cq_read(b.cq, &e, 0);
    } while (r == -FI_EAGAIN);
    if (r) { printf("send %zd\n", r); return 1; }
    struct fi_cq_tagged_entry e; int got = 0;
    for (long spin = 0; spin < 100000000 && !got; spin++) {
      struct fi_cq_tagged_entry x; fi_cq_read(a.cq, &x, 1);
      ssize_t n = fi_cq_read(b.cq, &e, 1);
      if (n == 1) got = 1; else if (n != -FI_EAGAIN) { struct fi_cq_err_entry er = {0}; fi_cq_readerr(b.cq, &er, 0); printf("cq err %d\n", er.err); return 1; }
    }
    printf("%s%s: sent tag %#llx, got tag %#llx data %#llx flags%s%s len %zu\n", inj ? "inject" : "send", data ? "data" : "", (unsigned long long)sent,
      (unsigned long long)e.tag, (unsigned long long)e.data, e.flags & FI_REMOTE_CQ_DATA ? " REMOTE_CQ_DATA" : "", e.flags & FI_TAGGED ? " TAGGED" : "", e.len);
  }
  return 0;
}
