/* How many 512-bit int8 dot products (vpdpbusd) one core of this CPU retires per second, in the pattern of a low-bit
 * tile: two weight registers, eight activations broadcast, 16 accumulators. The products' peak for NOTES.md.
 *     gcc -O2 -o /tmp/vnni_rate vnni_rate.c && /tmp/vnni_rate
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
#include <stdint.h>
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static int8_t buf[64*64] __attribute__((aligned(64)));
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) int main(void){
  for(int i=0;i<64*64;i++) buf[i]=i;
  __m512i a[16]; for(int i=0;i<16;i++)a[i]=_mm512_set1_epi32(i);
  long n=50000000; double t=now();
  for(long i=0;i<n;i++){
    __m512i w0=_mm512_load_si512(buf+(i&7)*64), w1=_mm512_load_si512(buf+((i+1)&7)*64);
#pragma GCC unroll 8
    for(int r=0;r<8;r++){ __m512i x=_mm512_set1_epi32(((int32_t*)buf)[r+(i&15)]);
      a[2*r]=_mm512_dpbusd_epi32(a[2*r],w0,x); a[2*r+1]=_mm512_dpbusd_epi32(a[2*r+1],w1,x);} }
  double dt=now()-t; int s=0; for(int i=0;i<16;i++) s+=_mm512_reduce_add_epi32(a[i]);
  printf("zmm vpdpbusd (2 weights x 8 broadcasts): %.2f G/s per core (%d)\n", 16.0*n/dt/1e9, s);
  return 0; }
