use super::*;

fn lost(id: u64) -> u64 {
    1000 + id
}

#[test]
fn awaited_answers_meet_whichever_side_comes_first() {
    // Completed before actix hands the sender over (an op answered inside its handler).
    let (answer, waiter) = deferred(1, lost);
    waiter.complete(7);
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    answer.hand_over(Some(tx));
    assert_eq!(rx.try_recv(), Ok(7));

    // Sender first, completion later.
    let (answer, waiter) = deferred(2, lost);
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    answer.hand_over(Some(tx));
    assert!(rx.try_recv().is_err());
    waiter.complete(8);
    assert_eq!(rx.try_recv(), Ok(8));

    // Nobody waits (`do_send`): the completion is dropped quietly.
    let (answer, waiter) = deferred(3, lost);
    answer.hand_over(None);
    waiter.complete(9);

    // The pipe drops the operation unanswered, before or after the hand-over.
    let (answer, waiter) = deferred(4, lost);
    drop(waiter);
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    answer.hand_over(Some(tx));
    assert_eq!(rx.try_recv(), Ok(1004));
    let (answer, waiter) = deferred(5, lost);
    let (tx, mut rx) = tokio::sync::oneshot::channel();
    answer.hand_over(Some(tx));
    drop(waiter);
    assert_eq!(rx.try_recv(), Ok(1005));
}
